"""The elastic simulator: the production elastic code on virtual time and a simulated
object store (docs/elastic.md#simulation). ``scheduler`` (the baton and the virtual
clock), ``store`` (the bucket and its profiles), ``world`` (members, churn, invariants);
``tools/elastic_sim.py`` is its command line."""
