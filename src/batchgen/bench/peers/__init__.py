"""Peers that run outside batchgen's own environment: vLLM's CPU build in a virtual environment of
its own (vllm_cpu.py runs it; vllm_driver.py is the script that environment's Python executes;
hf_folder.py converts the bundled GGUF into the HF folder it loads; setup_vllm_cpu.sh, through
`make vllm-peer`, makes both once)."""
