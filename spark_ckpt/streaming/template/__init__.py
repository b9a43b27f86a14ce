"""The template: streams that record their parents, keyed streams and their operators, the graph
of a pipeline's inputs and outputs, and what one batch computes with (its run)."""
