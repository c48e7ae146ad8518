package envlet

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

// FuzzPolicy replays arbitrary workloads through a controller and checks
// the policy's invariants: never above the cap or the
// node, memory never lowered below 1.25x the working set, at most one
// policy shrink per window per resource, grants within the node.
func FuzzPolicy(f *testing.F) {
	f.Add([]byte{3, 200, 10, 0, 0, 255, 250, 1, 0, 255, 250, 1, 0, 10, 5, 0, 0, 10, 5, 0})
	f.Add([]byte{7, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 4, 0, 0, 0})
	f.Add([]byte{1, 255, 255, 2, 255, 255, 255, 2, 255, 240, 255, 3})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) < 1 {
			return
		}
		cfg := DefaultConfig()
		cfg.Initial = Resources{CPU: 0.5, Memory: 256 * MiB}
		cfg.Cap = Resources{CPU: 8, Memory: 4 * GiB}
		cfg.CPUShrinkAfter, cfg.CPUCooldown, cfg.MemShrinkAfter = 2*time.Second, time.Second, 3*time.Second
		node := Resources{CPU: 1 + float64(data[0]%16), Memory: GiB * int64(1+data[0]%8)}
		arb := NewNodeArbiter(node, DefaultReserve)
		tr := newTrace(t, cfg, arb, 4)
		var busyUsage int64
		tr.cg.applyErr = func(r Resources) error {
			// v1 refuses only to lower the limit below usage.
			if r.Memory < tr.cg.limit.Memory && r.Memory < busyUsage {
				return ErrBusy
			}
			return nil
		}
		var lastShrink = map[string]time.Time{}
		other := false
		data = data[1:]
		for len(data) >= 4 && tr.tick < 2000 {
			demand, wsSel, flags, rep := data[0], data[1], data[2], data[3]
			data = data[4:]
			if flags&4 != 0 && !other {
				other = arb.Admit(context.Background(), "other", Resources{CPU: float64(flags>>4) / 4, Memory: int64(flags>>4) * 128 * MiB}) == nil
			} else if flags&8 != 0 && other {
				arb.Release(context.Background(), "other")
				other = false
			}
			for range 1 + int(rep%16) {
				before := tr.c.st.Limit
				ws := int64(float64(wsSel) / 255 * 1.2 * float64(before.Memory))
				usage := ws + int64(flags&3)*32*MiB
				busyUsage = 0
				if flags&16 != 0 {
					busyUsage = usage
				}
				err := tr.step(func(s *Sample) {
					s.MemUsage, s.InactiveFile = usage, usage-ws
					if flags&1 != 0 && wsSel > 200 {
						s.OOMKill++
					}
					s.UnderOOM = flags&2 != 0 && wsSel > 230
					tr.cpu(float64(demand) / 16)
				})
				after := tr.c.st.Limit
				if err != nil {
					var fe *FailureError
					if !errors.As(err, &fe) || (fe.Reason != ReasonNodeExhausted && fe.Reason != ReasonCapExceeded) {
						t.Fatalf("tick %d: unexpected error %v", tr.tick, err)
					}
					return
				}
				if after.CPU > cfg.Cap.CPU+1e-9 || after.Memory > cfg.Cap.Memory {
					t.Fatalf("tick %d: limits %v above cap %v", tr.tick, after, cfg.Cap)
				}
				if after.CPU > node.CPU+1e-9 || after.Memory > node.Memory {
					t.Fatalf("tick %d: limits %v above node %v", tr.tick, after, node)
				}
				if after.Memory < before.Memory && float64(after.Memory) < 1.25*float64(ws) {
					t.Fatalf("tick %d: memory lowered to %s with working set %s", tr.tick, FormatBytes(after.Memory), FormatBytes(ws))
				}
				if u := arb.Used(); u.CPU > node.CPU+1e-9 || u.Memory > node.Memory {
					t.Fatalf("tick %d: counted use %v above node %v", tr.tick, u, node)
				}
				p, _ := tr.c.last()
				for res, window := range map[string]time.Duration{"cpu": cfg.CPUShrinkAfter, "mem": cfg.MemShrinkAfter} {
					if !strings.Contains(p.Actions, res+" /2") && !strings.Contains(p.Actions, res+" busy") {
						continue
					}
					if last, ok := lastShrink[res]; ok && p.T.Sub(last) < window {
						t.Fatalf("tick %d: %s shrink %v after the previous one (window %v)\n%s", tr.tick, res, p.T.Sub(last), window, strings.Join(tr.log, "\n"))
					}
					lastShrink[res] = p.T
				}
			}
		}
	})
}

// FuzzNodeArbiter checks the arbiter's accounting under arbitrary calls:
// a Grow that raises a grant never lifts the counted use (the asker at its
// whole grant) above capacity minus reserve, a report never marks a victim
// while the counted memory use is under the eviction line, and no grant
// falls below its base.
func FuzzNodeArbiter(f *testing.F) {
	f.Add([]byte{0, 1, 40, 1, 1, 200, 0, 2, 40, 1, 3, 200, 2, 1, 10, 0, 5, 30})
	f.Add([]byte{0, 0, 255, 0, 1, 255, 0, 2, 255, 1, 0, 255, 3, 1, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		ctx := context.Background()
		node := Resources{CPU: 16, Memory: 16 * GiB}
		a := NewNodeArbiter(node, DefaultReserve)
		lim := Resources{CPU: node.CPU * 0.85, Memory: int64(float64(node.Memory) * 0.85)}
		ids := []string{"a", "b", "c", "d", "e", "f"}
		told := map[string]bool{} // evicted and told so: it stays evicted
		for len(data) >= 3 {
			op, id, v := data[0]%4, ids[int(data[1])%len(ids)], float64(data[2])
			data = data[3:]
			before := a.Leases()[id]
			switch op {
			case 0:
				a.Admit(ctx, id, Resources{CPU: v / 32, Memory: int64(v) * 32 * MiB})
			case 1:
				a.Grow(ctx, id, Resources{CPU: v / 8, Memory: int64(v) * 128 * MiB})
				ls := a.Leases()
				after := ls[id]
				var use Resources
				for oid, l := range ls {
					if oid == id {
						use.CPU += l.Grant.CPU
						use.Memory += l.Grant.Memory
						continue
					}
					use.CPU += math.Max(l.Grant.CPU-l.Base.CPU, 0) + math.Min(l.Used.CPU, l.Base.CPU)
					use.Memory += max(l.Grant.Memory-l.Base.Memory, 0) + min(l.Used.Memory, l.Base.Memory)
				}
				if after.Grant.CPU > before.Grant.CPU+1e-9 && use.CPU > lim.CPU+1e-9 ||
					after.Grant.Memory > before.Grant.Memory && use.Memory > lim.Memory {
					t.Fatalf("grow %v -> %v lifted the counted use to %v, above capacity minus reserve %v", before.Grant, after.Grant, use, lim)
				}
			case 2:
				cur := Resources{CPU: v / 8, Memory: int64(v) * 128 * MiB}
				u := a.Used()
				_, err := a.Report(ctx, id, cur, Resources{CPU: v / 64, Memory: int64(v) * 16 * MiB})
				var ev *EvictionError
				if errors.As(err, &ev) && !told[id] && u.Memory < node.Memory*7/8 && a.Used().Memory < node.Memory*7/8 {
					t.Fatalf("evicted %s with %v counted: %v", id, u, err)
				}
				told[id] = told[id] || ev != nil
			case 3:
				a.Release(ctx, id)
				delete(told, id)
			}
			for id, l := range a.Leases() {
				if l.Grant.CPU < l.Base.CPU-1e-9 || l.Grant.Memory < l.Base.Memory {
					t.Fatalf("%s grant %v below base %v", id, l.Grant, l.Base)
				}
			}
		}
	})
}
