"""What the compression costs: the cache registry the tools share, perplexity and KL through the
real cache path, needle-in-a-haystack retrieval with paired statistics, attention fidelity."""
