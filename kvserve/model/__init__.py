"""The torch side of kvserve: GGUF loading, the decoder, paged attention, sampling and the runner."""
