"""Graph passes over Dynamo FX graphs: find every attention and the KV-cache writes it reads, check that
the kvarn ops compute exactly that attention (``sites``), and rewrite it onto them (``rewrite``).
``graph`` holds the helpers (operation names, probe evaluation)."""

from .rewrite import KVarNAttentionPass, Report, kvarn_attention

__all__ = ["KVarNAttentionPass", "Report", "kvarn_attention"]
