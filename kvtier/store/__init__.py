"""The page store and placement: the page table, its tiers' policies, leases, integrity."""
