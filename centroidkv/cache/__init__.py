"""The compressed KV cache: the cache, its layers and head groups, the plans and budgets
that say what each group keeps, and how entries are stored."""
