"""The optimizers over the plugin interface: one definition per optimizer, the base class, and
the wrappers (mixed precision, sparse, QAT, data parallel). Nothing here asks which backend it is."""
