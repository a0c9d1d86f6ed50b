"""The disk tier: an LMCache L2 adapter plugin storing one self-describing file per object."""
