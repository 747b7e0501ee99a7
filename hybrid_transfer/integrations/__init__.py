"""Embeddings into serving engines; each subpackage imports its engine, the core never does."""
