"""k2fleet: take a fleet of GPU hosts to a serving Kimi-K2 deployment."""
