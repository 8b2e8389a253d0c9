"""Tool-call parsers by model family (hermes, llama3_json, mistral): extracting calls from generated text,
streaming them as deltas, and the grammars that make a model call in its own format."""
