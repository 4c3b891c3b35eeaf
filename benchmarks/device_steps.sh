# Steps a session's device script repeats (source it from the repository root on the device tool's GPU machine;
# results go under $OUT). A session's script (benchmarks/results/h200-s*/run.sh) is then its patches, runs and
# shapes; the commands stay here.

# record_env FILE: the date, the GPU and the torch / triton versions (date -u is appended again at the end).
record_env() {
    (date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") \
        > "$1" 2>&1
}

# start_call SCRIPT CASE: a session script's first step (run from the repository root): strict variables, $repo (the
# root) and $here (the script's folder, where its patches are), unbuffered Python output, the environment record
# ($OUT/env-CASE.txt), and matplotlib's font cache built once, outside the timed runs (on a fresh machine it took the
# first timed run past its limit: h200-s27, call1).
start_call() {
    set -u
    repo=$PWD
    here=$(dirname "$1")
    export PYTHONUNBUFFERED=1
    record_env "$OUT/env-$2.txt"
    python3 -c "import matplotlib.pyplot" 2>/dev/null
}

# packed_results CASE: a case's results in a folder of their own, /tmp/results-CASE (a warm machine keeps /tmp), OUT
# set to it (and final_out to the device's $OUT, the environment record copied there); `pack` then packs it into
# $final_out/results.tgz, which a script calls after each step so that a run cut short still returns what it did.
packed_results() {
    final_out=$OUT
    OUT=/tmp/results-$1 && rm -rf "$OUT" && mkdir -p "$OUT"
    cp "$final_out"/env-*.txt "$OUT"/
    pack() { tar czf "$final_out/results.tgz" -C "$OUT" .; }
}

# unknown_case CASE: a session script's answer to a case it does not have (a typo must not run nothing and succeed).
unknown_case() {
    echo "unknown case: $1" >&2
    exit 2
}

# end_call CASE: a session script's last step: the end time in its results' environment record, the results packed.
end_call() {
    date -u >> "$OUT/env-$1.txt"
    pack
}

# time_op RUN DIR SECONDS [attention.py arguments]: benchmarks/attention.py of the checkout at DIR into $OUT/RUN
# (log $OUT/RUN.log); prints its table rows and reference error prefixed by RUN, and any error lines.
time_op() {
    local run=$1 dir=$2 seconds=$3
    shift 3
    (cd "$dir/benchmarks" && PYTHONPATH=$dir timeout "$seconds" python3 attention.py --out "$OUT/$run" "$@") \
        > "$OUT/$run.log" 2>&1
    grep '^| [0-9]\|max abs' "$OUT/$run.log" | sed "s/^/$run /"
    grep -i 'error\|Traceback' "$OUT/$run.log" | head -3
}

# bench_script SCRIPT SECONDS RUN DIR [arguments]: benchmarks/SCRIPT of the checkout at DIR into $OUT/RUN (log
# $OUT/RUN.log, at most SECONDS); prints its table rows prefixed by RUN (or a timeline's), and any error lines.
bench_script() {
    local script=$1 seconds=$2 run=$3 dir=$4
    shift 4
    (cd "$dir/benchmarks" && PYTHONPATH=$dir timeout "$seconds" python3 "$script" --out "$OUT/$run" "$@") \
        > "$OUT/$run.log" 2>&1
    grep '^| [0-9]\|^| _\|^B[0-9]' "$OUT/$run.log" | sed "s/^/$run /"
    grep -i 'error\|Traceback' "$OUT/$run.log" | head -3
}

# decode_step RUN DIR [decode_step.py arguments]: benchmarks/decode_step.py (at most 150 s), as bench_script.
decode_step() { bench_script decode_step.py 150 "$@"; }

# flush_overlap RUN DIR [flush_overlap.py arguments]: benchmarks/flush_overlap.py (at most 300 s), as bench_script.
flush_overlap() { bench_script flush_overlap.py 300 "$@"; }

# gpu_tests DIR SECONDS [pytest arguments]: pytest in the checkout at DIR, 8 workers, into $OUT/tests.txt (the
# kernel, op and latent test files unless arguments are given); prints its summary.
gpu_tests() {
    local dir=$1 seconds=$2
    shift 2
    [ $# -gt 0 ] || set -- tests/test_kernels.py tests/test_ops.py tests/test_latent.py
    (cd "$dir" && timeout "$seconds" python3 -m pytest -q -p no:cacheprovider -n 8 "$@") > "$OUT/tests.txt" 2>&1
    tail -n 3 "$OUT/tests.txt"
}

# readme_table SECONDS: the README's decode table (attention.py --profile; cold L2, the default since session 53)
# of this checkout into $OUT/table.
readme_table() {
    local root=$PWD
    (cd benchmarks && PYTHONPATH=$root timeout "$1" python3 attention.py --out "$OUT/table" --profile) \
        > "$OUT/table.log" 2>&1
    tail -22 "$OUT/table.log"
}
