package shim_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
)

// TestSharedShim runs containers through shared shims ([shim]
// group-size 3) and kills one: the three containers of the first group
// share one shim process and the fourth gets another; deleting a
// container leaves its group's shim serving the others (and logging
// through another container's log pipe); SIGKILL of a
// shared shim ends every container it served (containerd reports each
// exited, their processes are gone) and nothing else; the next container
// starts on a new shim.
func TestSharedShim(t *testing.T) {
	s := newSuite(t, node{groupSize: "3"})
	ann := map[string]string{"initial-cpu": "0.25", "initial-memory": "128Mi"}
	var cs []*ctr
	var pids []int
	for range 5 {
		c, err := s.run(t, ann, "-mode", "idle", "-hold", "30m")
		if err != nil {
			t.Fatal(err)
		}
		pid, err := shimPid(c)
		if err != nil {
			t.Fatal(err)
		}
		cs, pids = append(cs, c), append(pids, pid)
	}
	if pids[0] != pids[1] || pids[0] != pids[2] || pids[3] == pids[0] || pids[4] != pids[3] {
		t.Fatalf("shim pids %v, want the first three and the last two shared", pids)
	}
	list := s.envsnap(t, "envs")
	for _, c := range cs {
		if !strings.Contains(list, c.id) {
			t.Errorf("%s not at the arbiter:\n%s", c.id, list)
		}
	}

	// Deleting the container the shim was started for leaves the shim
	// serving the other, and its log going to containerd through the
	// other's log pipe.
	ctx := s.env.Context()
	if _, err := cs[3].task.Delete(ctx, client.WithProcessKill); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if err := syscall.Kill(pids[3], 0); err != nil {
		t.Fatalf("shim %d ended with one of its two containers deleted: %v", pids[3], err)
	}
	if st, err := cs[4].task.Status(ctx); err != nil || st.Status != "running" {
		t.Fatalf("%s after its neighbour's delete: %v, %v", cs[4].id, st.Status, err)
	}
	var logged bool
	for deadline := time.Now().Add(10 * time.Second); !logged && time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		raw, err := os.ReadFile(s.env.Containerd.LogPath)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(raw), "\n") {
			logged = logged || strings.Contains(line, `msg="envlet: shim log moved"`) &&
				strings.Contains(line, " from="+cs[3].id+" ") && strings.Contains(line, " to="+cs[4].id)
		}
	}
	if !logged {
		t.Errorf("containerd's log has no line of the shim after its first container's delete (want it moved from %s to %s)", cs[3].id, cs[4].id)
	}

	// A shim's crash takes down the containers it served, only those.
	inits := make([]uint32, 3)
	for i, c := range cs[:3] {
		inits[i] = c.task.Pid()
	}
	if err := syscall.Kill(pids[0], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for i, c := range cs[:3] {
		code := c.wait(t, time.Minute)
		t.Logf("%s: exit %d after its shim's SIGKILL", c.id, code)
		deadline := time.Now().Add(30 * time.Second)
		for alive(int(inits[i])) && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		if alive(int(inits[i])) {
			t.Errorf("%s: process %d still runs after its shim died", c.id, inits[i])
		}
	}
	if st, err := cs[4].task.Status(ctx); err != nil || st.Status != "running" {
		t.Errorf("%s (another shim) after the crash: %v, %v", cs[4].id, st.Status, err)
	}
	c, err := s.run(t, ann, "-mode", "idle", "-hold", "30m")
	if err != nil {
		t.Fatalf("start after a shim crash: %v", err)
	}
	pid, err := shimPid(c)
	if err != nil {
		t.Fatal(err)
	}
	if pid == pids[0] {
		t.Errorf("new container on the dead shim's pid %d", pid)
	}
	if st, err := c.task.Status(ctx); err != nil || st.Status != "running" {
		t.Errorf("%s after the crash: %v, %v", c.id, st.Status, err)
	}
}

// alive reports whether pid runs (a zombie does not).
func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	return len(f) > 0 && f[0] != "Z"
}

// TestLingeringShimLogs: a container that joins a shared shim whose
// containers were all deleted (the shim lingers for the next) has its
// shim's log in containerd's log. The shim's log used to stay on the
// deleted container's pipe, which containerd no longer read: every
// line after the first container's delete was lost.
func TestLingeringShimLogs(t *testing.T) {
	s := newSuite(t, node{groupSize: "3"})
	ann := map[string]string{"initial-cpu": "0.25", "initial-memory": "128Mi"}
	ctx := s.env.Context()
	// The next container must reach the shim within its linger
	// (shim.GroupLinger); a slow node gets three tries.
	for try := 1; ; try++ {
		first, err := s.run(t, ann, "-mode", "idle", "-hold", "30m")
		if err != nil {
			t.Fatal(err)
		}
		shim, err := shimPid(first)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := first.task.Delete(ctx, client.WithProcessKill); err != nil {
			t.Fatal(err)
		}
		next, err := s.run(t, ann, "-mode", "idle", "-hold", "30m")
		if err != nil {
			t.Fatal(err)
		}
		pid, err := shimPid(next)
		if err != nil {
			t.Fatal(err)
		}
		if pid != shim {
			if try == 3 {
				t.Fatalf("no container joined its group's lingering shim in %d tries (shim %d, then %d)", try, shim, pid)
			}
			t.Logf("try %d: %s started on shim %d, not the lingering %d", try, next.id, pid, shim)
			continue
		}
		created := regexp.MustCompile(`msg="envlet: created".* id=` + regexp.QuoteMeta(next.id) + `(\s|$)`)
		var logged bool
		for deadline := time.Now().Add(10 * time.Second); !logged && time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			raw, err := os.ReadFile(s.env.Containerd.LogPath)
			if err != nil {
				t.Fatal(err)
			}
			logged = created.Match(raw)
		}
		if !logged {
			raw, _ := os.ReadFile(s.env.Containerd.LogPath)
			var lines []string
			for _, l := range strings.Split(string(raw), "\n") {
				if strings.Contains(l, "envlet") {
					lines = append(lines, l)
				}
			}
			t.Fatalf("containerd's log has no \"envlet: created\" line of %s, which joined lingering shim %d; its envlet lines:\n%s", next.id, shim, strings.Join(lines, "\n"))
		}
		return
	}
}

// TestSharedShimStartsTogether starts a group's containers at once, the
// way an RL batch lands: on a node with no shim, after the group's shim
// left at the end of its linger, and over the socket of a shim that was
// killed. Every container starts, and each round's share one shim.
// Starts of one group used to race for a socket a shim had left behind:
// one of two failed with "bind: address already in use".
func TestSharedShimStartsTogether(t *testing.T) {
	s := newSuite(t, node{groupSize: "3"})
	ann := map[string]string{"initial-cpu": "0.25", "initial-memory": "128Mi"}
	ctx := s.env.Context()
	var last int
	for _, round := range []string{"no shim", "after the shim's linger", "after the shim's SIGKILL"} {
		cs := make([]*ctr, 3)
		errs := make([]error, 3)
		var wg sync.WaitGroup
		for i := range cs {
			wg.Go(func() { cs[i], errs[i] = s.run(t, ann, "-mode", "idle", "-hold", "30m") })
		}
		wg.Wait()
		pids := map[int]bool{}
		for i, err := range errs {
			if err != nil {
				t.Fatalf("%s: container %d of 3 started together: %v", round, i+1, err)
			}
			pid, err := shimPid(cs[i])
			if err != nil {
				t.Fatal(err)
			}
			pids[pid] = true
			last = pid
		}
		if len(pids) != 1 {
			t.Errorf("%s: 3 containers of one group on shims %v, want one", round, pids)
		}
		t.Logf("%s: 3 containers started together on shim %d", round, last)
		if round == "no shim" {
			// Delete all three; the shim leaves after its linger.
			for _, c := range cs {
				if _, err := c.task.Delete(ctx, client.WithProcessKill); err != nil {
					t.Fatal(err)
				}
			}
			deadline := time.Now().Add(30 * time.Second)
			for alive(last) && time.Now().Before(deadline) {
				time.Sleep(200 * time.Millisecond)
			}
			if alive(last) {
				t.Fatalf("shim %d still runs 30 s after its last container's delete", last)
			}
		} else if round == "after the shim's linger" {
			// The next round joins the same group once these bundles,
			// which count as its members, are gone.
			bundles := make([]string, len(cs))
			for i, c := range cs {
				bundles[i] = filepath.Join(s.env.Dir, "state", "io.containerd.runtime.v2.task", c.ns, c.id)
				if _, err := os.Stat(bundles[i]); err != nil {
					t.Fatalf("bundle of %s: %v", c.id, err)
				}
			}
			if err := syscall.Kill(last, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			// Their bundles go with the deletes (containerd's own, once
			// it saw the shim die): the next round is the same group,
			// over the killed shim's socket.
			for _, c := range cs {
				c.wait(t, time.Minute)
				if _, err := c.task.Delete(ctx); err != nil && !errdefs.IsNotFound(err) {
					t.Fatal(err)
				}
			}
			for _, b := range bundles {
				deadline := time.Now().Add(30 * time.Second)
				for _, err := os.Stat(b); err == nil && time.Now().Before(deadline); _, err = os.Stat(b) {
					time.Sleep(100 * time.Millisecond)
				}
				if _, err := os.Stat(b); err == nil {
					t.Fatalf("bundle %s still there 30 s after its shim's SIGKILL", b)
				}
			}
		}
	}
}
