# envsnap build, test and demo entry points. Every target that needs the
# external tools (containerd, runc, registry, crictl, buildkit) depends on `deps`,
# which installs them idempotently into bin/tools.

SHELL   := /bin/bash
.SHELLFLAGS := -o pipefail -ec
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
# An execution count, not a duration: a duration races the fuzz coordinator's
# deadline on a loaded machine and fails with a bare "context deadline
# exceeded" (golang/go#75804). Any -fuzztime value works (e.g. FUZZTIME=30s).
FUZZTIME  ?= 50000x
# go test runs with -json through hack/testsummary, which prints what go
# test prints without -v and records the events; `make test` ends with the
# counts per package and one line "N passed, N failed, N skipped".
TESTSUMMARY := $(BIN)/testsummary
RESULTS     := $(BIN)/test-results

.PHONY: all deps vm-image kube daemonset-image kube-e2e build test unit e2e fuzz vet demo bench clean

all: build

deps:
	@hack/deps.sh

# The VM test bed's guest image (tests/vm) is built and cached under
# .cache/vm by hack/vm-image.sh; a no-op while its recipe is unchanged.
# Only the tests use it: `make demo` and `make bench` do not wait for it.
vm-image:
	@hack/vm-image.sh >/dev/null

# The one-node Kubernetes cluster of tests/kube (control plane, kubectl,
# kubelet, etcd, CNI plugins) is built from the Go module proxy and cached
# under .cache/kube by hack/kube.sh; a no-op while its recipe is unchanged.
kube:
	@hack/kube.sh >/dev/null

# The DaemonSet's image, built from deploy/image/Dockerfile with BuildKit
# and cached under .cache/image by hack/envsnap-image.sh (its base images
# are stand-ins made from Debian's packages: the script says why); a
# no-op while the Dockerfile and the Go sources are unchanged.
daemonset-image: deps
	@hack/envsnap-image.sh >/dev/null

# tests/kube, behind the build tag "kube" (it needs hack/kube.sh's
# binaries and the DaemonSet's image): part of `make test`. hack/kube.sh's
# build took 8.4 to 14.5 minutes on a fresh 2-core machine (empty module
# and build caches), the DaemonSet's image 2; its two tests, each on a
# guest of its own, about 9 minutes together.
kube-e2e: deps vm-image kube daemonset-image build $(TESTSUMMARY)
	@mkdir -p $(RESULTS)
	$(GO) test -json -tags kube -count=1 -timeout 40m ./tests/kube/ | $(TESTSUMMARY) -record $(RESULTS)/kube.json

build:
	$(GO) build -o $(BIN)/ ./cmd/containerd-envsnap ./cmd/containerd-shim-envlet-v2

vet:
	$(GO) vet ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { echo "gofmt needed:"; gofmt -l $$(git ls-files '*.go'); exit 1; }

$(TESTSUMMARY): hack/testsummary/main.go
	$(GO) build -o $@ ./hack/testsummary

unit: $(TESTSUMMARY)
	@mkdir -p $(RESULTS)
	$(GO) test -json -count=1 -timeout 15m $(UNIT_PKGS) | $(TESTSUMMARY) -record $(RESULTS)/unit.json

e2e: build $(TESTSUMMARY)
	@mkdir -p $(RESULTS)
	$(GO) test -json -count=1 -p 1 -timeout 25m $(E2E_PKGS) | $(TESTSUMMARY) -record $(RESULTS)/e2e.json

fuzz:
	@hack/fuzz.sh $(FUZZTIME)

test: deps vm-image kube daemonset-image build vet unit e2e kube-e2e fuzz
	@$(TESTSUMMARY) -report $(RESULTS)/unit.json $(RESULTS)/e2e.json $(RESULTS)/kube.json

demo: deps build
	$(GO) run ./bench/cmd/envsnap-demo

# The rollout (48 agent episodes submitted at once to one node, status quo,
# overlayfs everything at once, envsnap and the ablations side by side: its
# section of docs/benchmarks.md and docs/img/rollout-*.png), the density
# ramp (real agent environments started one after another until the node
# refuses, one fails or tool calls slow past 1.3x alone; envsnap, the
# status quo and overlayfs + runc with no limit, its section of
# docs/benchmarks.md), then the
# iteration headline, which regenerates docs/benchmarks.md and its plots
# (keeping the rollout's section), the peer tier's 4-node run
# (its section of docs/benchmarks.md), the peer tier's cluster model
# (docs/scale.md's table; about a minute of CPU), the micro-benchmarks
# (format, fetcher, FUSE, sampler) and the end-to-end benchmarks gated by
# ENVSNAP_BENCH=1 (among them tests/vm's KSM run across identical agent
# CLIs in the guest, about 11 minutes), and how soon the workload's base
# layer gets its native copy on an idle, a busy and a saturated node
# (about 2 minutes). Raw output in bench/out.
MICRO_BENCH_PKGS := ./layerfmt/ ./internal/fetch/ ./internal/lazyfs/ ./internal/layerstore/ ./internal/envlet/cgroupfs/ ./internal/idleprio/
BENCH_ARGS ?=

bench: deps build
	@mkdir -p bench/out
	$(GO) run ./bench/cmd/envsnap-bench -publish -variant small -rollouts 48 -rollout-tasks 8 2>&1 | tee bench/out/rollout.txt
	$(GO) run ./bench/cmd/envsnap-bench -publish -variant small -density 96 -density-step 4 -rollout-tasks 8 -no-prefetch 2>&1 | tee bench/out/density.txt
	$(GO) run ./bench/cmd/envsnap-bench -publish $(BENCH_ARGS) 2>&1 | tee bench/out/headline.txt
	$(GO) run ./bench/cmd/envsnap-bench -publish -variant small -peers 4 -peer-envs 4 -peer-slow-hedge-after 2s -peer-slow-timeout 30s 2>&1 | tee bench/out/peers.txt
	$(GO) run ./bench/cmd/envsnap-peersim 2>&1 | tee bench/out/peersim.txt
	$(GO) test -count=1 -run '^$$' -bench . -benchmem $(MICRO_BENCH_PKGS) 2>&1 | tee bench/out/micro.txt
	ENVSNAP_BENCH=1 $(GO) test -count=1 -p 1 -timeout 90m -v -run '^TestBench' -bench . -benchtime 1x ./tests/... 2>&1 | tee bench/out/e2e.txt
	ENVSNAP_BENCH=1 $(GO) test -count=1 -timeout 60m -v -run '^TestBenchNativeCopyBusyNode$$' ./internal/layerstore/ 2>&1 | tee bench/out/native-busy.txt

clean:
	rm -rf $(BIN)
