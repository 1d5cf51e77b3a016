"""Real vLLM CPU servers on this machine, for tests and benchmarks.

`tiny_model` builds a random-weight Llama with a MiniMax-M3-style chat template (nothing is downloaded);
`launcher` starts and stops `vllm.entrypoints.openai.api_server` processes from the separate vLLM virtualenv.
Nothing here imports torch or vLLM into the gateway's own interpreter.
"""
