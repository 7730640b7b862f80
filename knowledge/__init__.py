"""The knowledge path: STT, oracle policy, conversation and LLM client that write each call's oracle."""
