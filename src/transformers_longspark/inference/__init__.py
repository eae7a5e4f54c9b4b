"""Speculative decoding with a LongSpark drafter: the drafting session and its proposal sources (`session.py`,
`drafting.py`, `lookup.py`), and the loops that drive it: transformers' batch-1 `generate` (`generation.py`), batches
(`batched.py`), and the fast verification path both use (`verification.py`). vLLM's driver is `..vllm`."""
