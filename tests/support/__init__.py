"""What several tests share: data and models (`helpers`), and the functions
that run in other processes, one module per user (`*_workers`,
`elastic_inputs`). Importable in worker processes: no pytest here.
"""
