"""Flow control: who goes first when a model's engines are full (priority classes, fair queueing
between tenants charged on uncached prompt tokens and output tokens). Above `request`, beside
`proxy`, `trimming` and `tenants`: it imports none of them."""
