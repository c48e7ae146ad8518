# envsnap build, test and demo entry points. Every target that needs the
# external tools (containerd, runc, registry, crictl) depends on `deps`,
# which installs them idempotently into bin/tools.

GO      ?= go
BIN     := $(CURDIR)/bin
TOOLS   := $(BIN)/tools
export PATH := $(BIN):$(TOOLS):$(PATH)
export ENVSNAP_BIN := $(BIN)
export ENVSNAP_TOOLS := $(TOOLS)

# Unit packages run in parallel; end-to-end packages under tests/ run one at
# a time because they measure CPU and memory behaviour of real containers on
# a 2-core machine and would disturb each other.
UNIT_PKGS := $$($(GO) list ./... | grep -v /tests/)
E2E_PKGS  := ./tests/...
FUZZTIME  ?= 10s

.PHONY: all deps build test unit e2e fuzz vet demo bench clean

all: build

deps:
	@hack/deps.sh

build:
	$(GO) build -o $(BIN)/ ./cmd/containerd-envsnap ./cmd/containerd-shim-envlet-v2

vet:
	$(GO) vet ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { echo "gofmt needed:"; gofmt -l $$(git ls-files '*.go'); exit 1; }

unit:
	$(GO) test -count=1 -timeout 15m $(UNIT_PKGS)

e2e: build
	$(GO) test -count=1 -p 1 -timeout 25m $(E2E_PKGS)

fuzz:
	@hack/fuzz.sh $(FUZZTIME)

test: deps build vet unit e2e fuzz

demo: deps build
	$(GO) run ./bench/cmd/envsnap-demo

bench: deps build
	$(GO) run ./bench/cmd/envsnap-bench

clean:
	rm -rf $(BIN)
