"""Few short ablations, then one big run: the grid of a sweep (`grid`), running it
(`execute`), comparing its trials (`compare`) and promoting the winner (`promote`, with the
muP/depth-muP `transfer` rule)."""
