"""Data layer: text sources, tokenizers, the `.bin` shard format, preparation and the token loader.

Submodules are imported directly (`speedrun.data.loader`, ...) so that preparing data never imports
torch and training never imports the text sources.
"""
