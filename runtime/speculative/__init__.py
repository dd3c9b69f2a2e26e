"""Speculative decoding's building blocks: verification of drafted tokens (`verify`), the n-gram /
prompt-lookup proposer (`ngram`) and the adaptive choice of how many tokens to draft (`adaptive`).
The engine wires them together; the block manager's `trim` rolls back rejected tokens."""
