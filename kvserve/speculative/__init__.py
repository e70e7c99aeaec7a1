"""Speculative decoding, torch-free: the configuration (config.py: vLLM's `--speculative-config`), the
n-gram proposer over a request's own tokens (ngram.py), and the policy that sizes each request's drafts
per step and counts what verification kept (policy.py). The target model verifies the drafts in its
normal step (model/spec_verify.py); the cache manager rolls rejected positions back (truncate)."""
