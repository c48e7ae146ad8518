package devenv

import (
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"testing"
)

// The daemons an Env starts run in process groups of their own (so a
// test can stop one without the others), and a signal sent to a test
// binary's group does not reach them: a `go test` or `make test`
// stopped with Ctrl-C or SIGTERM would leave the daemons, their FUSE
// mounts, loop devices and the containers' processes running. So in a
// test binary the first SIGINT or SIGTERM tears down every open Env
// before the binary exits; a second one ends it at once. Programs (the
// bench, the demo) cancel their own context on a signal and close their
// Env on the way out, so they are left alone.
var open struct {
	sync.Mutex
	envs  map[*Env]struct{}
	watch sync.Once
}

// track records e as open until untrack, and in a test binary starts
// watching for the signals that should tear it down.
func track(e *Env) {
	open.Lock()
	if open.envs == nil {
		open.envs = map[*Env]struct{}{}
	}
	open.envs[e] = struct{}{}
	open.Unlock()
	if testing.Testing() {
		open.watch.Do(func() { go closeOnSignal() })
	}
}

func untrack(e *Env) {
	open.Lock()
	delete(open.envs, e)
	open.Unlock()
}

func closeOnSignal() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	s := <-sigs
	signal.Reset(syscall.SIGINT, syscall.SIGTERM)
	open.Lock()
	envs := make([]*Env, 0, len(open.envs))
	for e := range open.envs {
		envs = append(envs, e)
	}
	open.Unlock()
	fmt.Fprintf(os.Stderr, "devenv: %v: tearing down %d environments (a second signal ends the test binary at once)\n", s, len(envs))
	var wg sync.WaitGroup
	for _, e := range envs {
		wg.Go(func() {
			if leaked := e.Close(); len(leaked) > 0 {
				fmt.Fprintf(os.Stderr, "devenv: %s: mounts left after its daemons stopped: %v\n", e.Dir, leaked)
			}
		})
	}
	wg.Wait()
	os.Exit(2)
}
