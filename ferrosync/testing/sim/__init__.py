"""The elastic simulator: the production elastic code on virtual time and a simulated
object store (docs/elastic.md#simulation). ``scheduler`` (the baton and the virtual
clock), ``store`` (the bucket and its profiles), ``world`` (members, churn, invariants);
``cli`` its command line, ``python tools/elastic_sim.py``."""
