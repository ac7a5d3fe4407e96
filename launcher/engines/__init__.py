"""Generation engines the launcher starts: real vLLM servers and the vLLM-compatible simulator."""
