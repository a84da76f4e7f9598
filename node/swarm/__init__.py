"""What a peer does with others: the exchange seam, signed batches and their verification, the choice of J."""
