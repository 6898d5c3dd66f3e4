"""Data layer: sources, tokenizers, the `.bin` shard format, preparation and the loaders. Submodules are
imported directly, so preparing data never imports torch and training never imports the sources."""
