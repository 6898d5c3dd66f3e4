"""speedrun: the NanoGPT speedrun as an installable, tested package."""

__version__ = "0.1.0"
