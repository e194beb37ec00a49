"""The subgraphs trifuse finds, written as plain PyTorch functions, each with its replacement."""
