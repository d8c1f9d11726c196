"""Client library and CLI for inflight servers."""
