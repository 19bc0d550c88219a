"""The reference CPU policy: a small numpy model with a real BPE tokenizer, served over vLLM's and
SGLang's HTTP protocols so the whole pipeline and its log-probability check run without a GPU.

Entry points: ``server.main`` / ``server.serve_policy`` (the server), ``model.default_model`` (the
weights it serves by default), ``tokenizer.load_tokenizer`` / ``tokenizer.DEFAULT_TOKENIZER_DIR``.
Nothing is imported here, so ``python -m rolloutd.daemon.policy.server`` runs cleanly.
"""
