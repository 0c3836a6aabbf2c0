"""State that outlives a process: the stores, the journal and its records, the leader
lease, and the event streams clients follow."""
