"""knapspec: training-free self-speculative decoding with knapsack-chosen draft layers."""
