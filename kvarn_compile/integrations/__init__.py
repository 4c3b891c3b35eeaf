"""Integrations of the KVarN cache with model libraries (each imports its library lazily)."""
