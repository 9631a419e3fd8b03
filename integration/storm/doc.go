// Package storm reproduces the batch-export incident end to end (one tenant's export filled a
// shared LLM pool and chat P99 went from 1.4 s to 23 s): chat users and a batch summarisation
// export share one upstream LLM pool (mockllm with a Capacity), requests
// pass through the Envoy simulator and, depending on the configuration, through llm-bulkhead,
// and the chat latency distribution is compared with and without the storm and with and
// without a policy.
//
// The same machinery runs the provider brownout (BrownoutScenario, BrownoutConfigurations): chat
// users and a steady batch load on one provider whose capacity follows a mockllm capacity
// schedule (10, then 4, then 10 again), with the provider's limit of a built-in policy at 10,
// at 4 and adaptive. Each request's wait is split between the provider's queue (mockllm's
// x-mockllm-queue-wait) and the way to it, and each run is traced: the capacity, the limit and
// both queues about every quarter of a simulated second.
//
// One Run executes every Configuration Options.Repeat times, each time on a fresh stack
// (mockllm + llm-bulkhead + envoysim from package harness), interleaving the configurations so
// that a change in machine load hits them all alike. A Report holds every request of every run
// and per-configuration medians with their spread; it renders the Markdown table, an SVG chart
// of the chat latency distributions and a JSON file of the raw numbers.
//
// # Time
//
// Every duration of a Scenario is simulated time: the seconds of the scenario as described. Options.TimeScale runs
// the whole experiment faster: mockllm's latency model and the users' think times are
// multiplied by it, and so are the policy's waits (max_wait) and breaker durations
// (slow_call_duration, wait_in_open and their relatives), which are rewritten in a copy of the
// policy (DerivePolicy). Latencies are reported divided by the scale, in simulated seconds.
// What cannot be scaled is the one-minute window of token budgets and request rates; a
// Scenario therefore lasts less than a simulated minute, so that in real time and scaled alike
// no charge ages out of a window during a run and a budget caps the whole run the same way.
// What the scale does magnify is the proxy's own per-request cost, which is not simulated: a
// millisecond of ext_proc work reads as 1/TimeScale milliseconds in the tables.
package storm
