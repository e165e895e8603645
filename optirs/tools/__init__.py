"""Commands: ``optirs info``, ``optirs bench``, ``optirs occupancy`` and plots."""
