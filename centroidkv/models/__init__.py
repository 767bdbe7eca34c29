"""Models: naming, checking and loading them (hub, wheels, GGUF and converted files), and
the prompt as a model reads it. Importing this package imports nothing heavy."""
