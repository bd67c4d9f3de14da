"""One router per area of the Tinker API, vLLM-style; each only translates and delegates."""
