"""Speculative decoding, torch-free: the n-gram proposer over a request's own tokens (ngram.py), the draft
model's private pages (draft_kv.py), and the policy that sizes each request's drafts per step and counts what
verification kept (policy.py); its flags are parsed at the config level (kvserve/speculative_config.py). The
target model verifies the drafts in its normal step (model/spec_verify.py); the cache manager rolls rejected
positions back (truncate)."""
