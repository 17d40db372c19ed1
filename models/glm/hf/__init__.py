"""transformers GLM directories: the config.json map (`config`, `json_types`), the state-dict
adapter (`adapter`: our keys to the files' and back), block-wise fp8 (`fp8`) and the streamed
export (`adapter.write_hf`) and import (`load`)."""
