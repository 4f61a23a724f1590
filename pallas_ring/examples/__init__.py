"""Small example models built on pallas_ring."""
