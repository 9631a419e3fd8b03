package spend

import "github.com/llm-bulkhead/llm-bulkhead/policy/money"

// Micros is an amount of money in millionths of the currency unit (1_100_000 is 1.10): the
// unit prices, budgets and costs are counted in. It is money.Micros, where amounts are parsed
// and written.
type Micros = money.Micros
