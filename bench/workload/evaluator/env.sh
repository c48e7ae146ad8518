# Environment for the evaluator and the scripted episode. The container has
# no network: modules come from the module cache shipped with the task
# group, builds reuse its warm build cache.
export HOME=/root
export PATH=/opt/harness/bin:/usr/local/go/bin:/root/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export GOTOOLCHAIN=local GOPROXY=off GOSUMDB=off GOFLAGS=-mod=mod
export GOPATH=/root/go GOMODCACHE=/root/go/pkg/mod GOCACHE=/root/.cache/go-build
export LANG=C.UTF-8
