"""The HiState runtime: the policy core wired to one LMCache server process, as owned parts."""
