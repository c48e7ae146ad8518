package arbiter

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/containerd/log"

	"github.com/envsnap/envsnap/internal/envlet"
)

// DefaultLedgerGrace is how long an environment restored from the ledger
// keeps its grant without a word from its shim. Shims redial a lost
// connection every second and re-register at once; one silent for 10 s
// ended while the arbiter was down, and its grant goes back to the node.
const DefaultLedgerGrace = 10 * time.Second

// ledgerVersion is the format of the ledger file.
const ledgerVersion = 1

// DefaultLedgerPath is where the ledger of an arbiter on socket lives: next
// to the socket, on /run (tmpfs), because after a reboot no environment it
// describes is left.
func DefaultLedgerPath(socket string) string {
	return filepath.Join(filepath.Dir(socket), "arbiter-ledger.json")
}

// ledgerFile is the arbiter's persisted state: every live lease, so a
// restarted arbiter knows the node's commitments before it answers
// anyone. Usage is kept too; it is refreshed by the next reports.
type ledgerFile struct {
	Version int           `json:"version"`
	Envs    []ledgerEntry `json:"envs"`
}

type ledgerEntry struct {
	Env      string    `json:"env"`
	Owner    string    `json:"owner,omitempty"`
	Base     Resources `json:"base"`
	Grant    Resources `json:"grant"`
	Used     Resources `json:"used"`
	Admitted time.Time `json:"admitted"`
	Priority int       `json:"priority,omitempty"`
	Tier     string    `json:"tier,omitempty"`
}

// UseLedger makes s persist its leases at path after every change of a
// grant, and restores the leases recorded there first. Call it before
// serving: the restored grants are what keeps a restarted arbiter from
// handing the same memory out twice before every shim has re-registered.
func (s *Server) UseLedger(ctx context.Context, path string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ledger = path
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read arbiter ledger: %w", err)
	}
	var lf ledgerFile
	if err := json.Unmarshal(b, &lf); err != nil || lf.Version != ledgerVersion {
		// A ledger we cannot read is set aside, not fatal: the shims
		// re-register within seconds anyway.
		bad := path + ".bad"
		_ = os.Rename(path, bad)
		log.G(ctx).WithError(err).WithField("moved_to", bad).Warn("arbiter: unreadable ledger set aside; starting empty")
		return nil
	}
	now := time.Now()
	for _, e := range lf.Envs {
		if e.Env == "" || valid(e.Base, e.Grant, e.Used) != nil {
			log.G(ctx).WithField("env", e.Env).Warn("arbiter: skipping an invalid ledger entry")
			continue
		}
		s.arb.Restore(e.Env, envlet.Lease{Base: fromWire(e.Base), Grant: fromWire(e.Grant), Used: fromWire(e.Used), Priority: e.Priority, Tier: envlet.Tier(e.Tier), Admitted: e.Admitted})
		s.envs[e.Env] = &record{info: EnvInfo{Env: e.Env, Owner: e.Owner, Base: e.Base, Current: e.Grant, Used: e.Used,
			Admitted: e.Admitted, Updated: now, Priority: e.Priority, Tier: e.Tier}}
		s.restored[e.Env] = now.Add(s.grace)
	}
	s.lastLedger = s.ledgerKeyLocked()
	log.G(ctx).WithField("envs", len(s.restored)).WithField("ledger", path).Info("arbiter: leases restored from the ledger")
	return nil
}

// ledgerKeyLocked is the ledger without usage: a change of usage alone is
// not worth a write, a change of any grant is.
func (s *Server) ledgerKeyLocked() []byte {
	lf := s.ledgerLocked(false)
	b, _ := json.Marshal(lf)
	return b
}

func (s *Server) ledgerLocked(withUse bool) ledgerFile {
	lf := ledgerFile{Version: ledgerVersion, Envs: make([]ledgerEntry, 0, len(s.envs))}
	leases := s.arb.Leases()
	for id, rec := range s.envs {
		l, ok := leases[id]
		if !ok {
			continue
		}
		e := ledgerEntry{Env: id, Owner: rec.info.Owner, Base: toWire(l.Base), Grant: toWire(l.Grant),
			Admitted: rec.info.Admitted, Priority: l.Priority, Tier: string(l.Tier)}
		if withUse {
			e.Used = toWire(l.Used)
		}
		lf.Envs = append(lf.Envs, e)
	}
	sort.Slice(lf.Envs, func(i, j int) bool { return lf.Envs[i].Env < lf.Envs[j].Env })
	return lf
}

// lockForChange takes the server's lock for a call that may change the
// ledger. The function it returns takes the change (persistLocked) and
// unlocks. The write runs outside the lock: a call that changed a grant or
// the set of environments is answered once the ledger holding its change
// is on file; a change of usage alone is written in the background, as
// the next report restates it anyway. Under the lock, a write and rename
// took up to 555 ms on a node busy with writes (48 environments starting
// at once, the ledger on ext4; timed once, docs/shim.md), and every call
// waited behind it.
func (s *Server) lockForChange(ctx context.Context) (unlock func()) {
	s.mu.Lock()
	return func() {
		seq, grants := s.persistLocked()
		s.mu.Unlock()
		switch {
		case grants:
			s.writeLedger(ctx, seq)
		case seq != 0:
			go s.writeLedger(context.WithoutCancel(ctx), seq)
		}
	}
}

// persistLocked takes the ledger's new content when a grant or the set of
// environments changed since the last one (grants), or usage alone after
// ledgerUseEvery, and returns its number for writeLedger; 0 when nothing
// is to be written.
func (s *Server) persistLocked() (seq uint64, grants bool) {
	if s.ledger == "" {
		return 0, false
	}
	key := s.ledgerKeyLocked()
	now := time.Now()
	grants = !bytes.Equal(key, s.lastLedger)
	if !grants && now.Sub(s.ledgerAt) < ledgerUseEvery {
		return 0, false
	}
	b, err := json.Marshal(s.ledgerLocked(true))
	if err != nil || bytes.Equal(b, s.lastLedgerUse) {
		s.ledgerAt = now
		return 0, false
	}
	s.ledgerSeq++
	s.ledgerNext = b
	s.lastLedger, s.lastLedgerUse, s.ledgerAt = key, b, now
	return s.ledgerSeq, grants
}

// writeLedger returns once content seq, or a newer one, is on file. The
// write goes to a temporary file renamed over the ledger, so a crash
// leaves the old or the new ledger, never half. No fsync: the ledger
// lives on tmpfs and a power loss ends every environment it describes.
// Concurrent callers share a write: the newest content covers every
// change before it.
func (s *Server) writeLedger(ctx context.Context, seq uint64) {
	if seq == 0 || s.ledgerDone.Load() >= seq {
		return
	}
	s.ledgerWrite.Lock()
	defer s.ledgerWrite.Unlock()
	if s.ledgerDone.Load() >= seq {
		return
	}
	s.mu.Lock()
	b, newest := s.ledgerNext, s.ledgerSeq
	s.mu.Unlock()
	tmp := s.ledger + ".tmp"
	err := os.WriteFile(tmp, b, 0o600)
	if err == nil {
		err = os.Rename(tmp, s.ledger)
	}
	if err != nil {
		log.G(ctx).WithError(err).Warn("arbiter: persist ledger")
		// Written again at the next call, whatever changed by then.
		s.mu.Lock()
		s.lastLedger, s.lastLedgerUse = nil, nil
		s.mu.Unlock()
	}
	s.ledgerDone.Store(newest)
}

// flushLedger returns once the newest content is on file. A stopping
// arbiter leaves its successor every change it answered, usage included:
// a usage write still running in the background when a restarted arbiter
// read the ledger gave it leases without their use, whose grants it then
// lent to others (TestLedgerRestart, 3 runs in 30).
func (s *Server) flushLedger(ctx context.Context) {
	s.mu.Lock()
	seq := s.ledgerSeq
	s.mu.Unlock()
	s.writeLedger(ctx, seq)
}

// ledgerUseEvery bounds how often usage alone rewrites the ledger: shims
// report once a second each, and usage lost in a crash is re-reported
// within a second anyway.
const ledgerUseEvery = time.Second

// confirmLocked marks env as heard from after a restore.
func (s *Server) confirmLocked(env string) { delete(s.restored, env) }

// DefaultStaleAfter is how long a live environment may go without a call
// from its shim before the arbiter returns its grant. Shims report every
// second, idle environments every 15 s (envlet.IdleReportPeriod); a Release lost to a timeout (the shim gives up on an unreachable
// arbiter and forgets the environment) would otherwise hold the node's
// capacity forever. A live shim that was merely silent gets NotFound at
// its next report and re-registers.
const DefaultStaleAfter = 30 * time.Second

// expireLocked releases restored environments whose shim stayed silent
// for the grace period, and live ones silent for DefaultStaleAfter.
func (s *Server) expireLocked(ctx context.Context, now time.Time) {
	for env, rec := range s.envs {
		if _, restored := s.restored[env]; restored || now.Sub(rec.info.Updated) < s.stale {
			continue
		}
		log.G(ctx).WithField("env", env).WithField("silent", now.Sub(rec.info.Updated).Round(time.Second)).
			Warn("arbiter: no word from the environment's shim; releasing its grant")
		s.endLocked(ctx, env, "no report from its shim")
	}
	for env, deadline := range s.restored {
		if now.Before(deadline) {
			continue
		}
		delete(s.restored, env)
		log.G(ctx).WithField("env", env).Info("arbiter: restored environment not heard from; releasing its grant")
		s.endLocked(ctx, env, "not re-registered after an arbiter restart")
	}
}
