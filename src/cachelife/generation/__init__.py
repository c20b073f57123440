"""The fast loop: `cachelife.generate` (`api`) decodes what `model.generate` prepares in one compiled,
graph-captured step (`method`, `searches`, `steps`, `step_code`, `graphs`, `host`, `padding`, `states`), with
transformers' processors (`processors`, `tensor_processors`), greedy search and sampling (`greedy`) and beam
search (`beams`) as tensor operations; `arguments` says what falls back; `decode` is the bare-config preset.
"""
