# llm-bulkhead — run `make help` for the targets.
GO       ?= go
PKGS     ?= ./...
# How long `make fuzz` fuzzes each of its ~60 targets. Every `go test` (so `make test`) already runs
# each target's seed corpus; CI then fuzzes each target for 2 s (.ci/run), and
# `make fuzz FUZZTIME=10m PKGS=./extproc/llmapi` goes deep on one package.
FUZZTIME ?= 5s
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
# The version stamped into llm-bulkhead (`llm-bulkhead version`, llm_bulkhead_build_info): git
# describe in a checkout; without git or outside a checkout, nothing is stamped and the binary
# reports the module version from the Go build record instead. Override with VERSION=v1.2.3.
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null)
LDFLAGS  := $(if $(strip $(VERSION)),-X main.version=$(strip $(VERSION)))
# go-control-plane's generated marshalling (vtprotobuf) for the replies; without the tag the
# server marshals with protobuf's reflection, correct but slower.
export GOFLAGS := $(strip $(GOFLAGS) -tags=vtprotobuf)

.DEFAULT_GOAL := help

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: build
build: ## Build llm-bulkhead, mockllm, envoysim and storm into bin/
	$(GO) build -ldflags "$(LDFLAGS)" -o bin/ ./cmd/llm-bulkhead ./cmd/mockllm ./integration/envoysim/cmd/envoysim ./integration/cmd/storm

# The image `make image` builds and tags.
IMAGE    ?= llm-bulkhead:$(or $(strip $(VERSION)),dev)

.PHONY: image
image: ## Build the container image from examples/Dockerfile, version stamped (needs a running Docker)
	@if docker info >/dev/null 2>&1; then \
	  docker build -f examples/Dockerfile --build-arg VERSION="$(strip $(VERSION))" \
	    --build-arg REVISION="$$(git rev-parse HEAD 2>/dev/null)" -t "$(IMAGE)" . ; \
	else \
	  echo "make image: no Docker daemon reachable here; on a machine with Docker run:"; \
	  echo "  docker build -f examples/Dockerfile --build-arg VERSION=$(strip $(VERSION)) -t $(IMAGE) ."; \
	fi

.PHONY: run
run: ## Run the server with the built-in policy (ext_proc on 127.0.0.1:9002, admin on 127.0.0.1:9090)
	$(GO) run -ldflags "$(LDFLAGS)" ./cmd/llm-bulkhead serve

.PHONY: test
# `go test -vet=all` runs every analyzer of `go vet` on each package as it builds it (test files
# included, and the packages without tests): one pass over the code and its dependencies instead of
# a `go vet` pass and then go test's own smaller one. `make lint` runs `go vet` on its own.
test: ## go vet (every analyzer), every test with the race detector (fuzz targets' seed corpora included), the deploy module's tests
	$(GO) test -race -vet=all -count=1 -timeout 15m $(PKGS)
	$(MAKE) --no-print-directory test-deploy

.PHONY: test-deploy
test-deploy: ## Validate the Helm chart and the gateway examples in deploy/ (a module of its own)
	cd deploy && $(GO) test -vet=all -count=1 ./...

.PHONY: test-race
test-race: ## Run every test with the race detector, nothing else
	$(GO) test -race -count=1 -timeout 15m $(PKGS)

.PHONY: fuzz
fuzz: ## Run each fuzz target of PKGS for FUZZTIME (default 5s)
	GO="$(GO)" FUZZTIME=$(FUZZTIME) scripts/fuzz.sh $(PKGS)

.PHONY: lint
lint: ## go vet and staticcheck
	$(GO) vet $(PKGS)
	$(GO) run $(STATICCHECK) $(PKGS)
	cd deploy && $(GO) vet ./... && $(GO) run $(STATICCHECK) ./...

.PHONY: bench
bench: ## Benchmarks: hot paths, and llm-bulkhead against a no-op ext_proc server under the same load
	$(GO) test -run '^$$' -bench . -benchmem -count 1 ./policy/... ./extproc/...
	$(GO) run ./integration/cmd/bench

.PHONY: bench-cluster
bench-cluster: ## Cluster-mode benchmark: exact and leased admission against local, fleets of 3-30 replicas on one Redis and a Redis Cluster, skew and churn (needs redis-server, redis-cli)
	$(GO) run ./integration/cmd/bench/cluster

.PHONY: demo
demo: ## The batch-export incident in miniature: chat and a batch storm through envoysim, llm-bulkhead and mockllm
	$(GO) run ./integration/cmd/storm --demo

.PHONY: cluster-demo
cluster-demo: ## Three replicas hold the example policy fleet-wide through Redis, then, without it, admit 3× (needs redis-server)
	$(GO) run ./integration/cmd/clusterdemo

.PHONY: storm
storm: ## The batch-export incident, the provider brownout (static vs adaptive limits), then the provider quota running out (off, shadow, enforce); results in results/storm, results/storm-brownout and results/storm-quota
	$(GO) run ./integration/cmd/storm --fast --out results/storm
	$(GO) run ./integration/cmd/storm --scenario brownout --out results/storm-brownout
	$(GO) run ./integration/cmd/storm --scenario quota --out results/storm-quota

.PHONY: clean
clean: ## Remove build outputs and results
	rm -rf bin/ results/
