"""The evaluation suite: needle retrieval, perplexity under eviction, output fidelity, sweeps and
reports."""
