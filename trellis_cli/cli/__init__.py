"""The command-line layer: the only code that prints, prompts or exits."""
