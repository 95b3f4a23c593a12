"""Example entry points for `recycle launch --entry` (e.g. `examples.hf_gpt2:training`)."""
