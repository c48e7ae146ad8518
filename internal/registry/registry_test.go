package registry

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCredentials(t *testing.T) {
	dir := t.TempDir()
	cfg := `{"auths": {
		"127.0.0.1:5000": {"auth": "dXNlcjpwYXNzOndvcmQ="},
		"https://index.docker.io/v1/": {"username": "hub", "password": "secret"},
		"tok.example": {"identitytoken": "refresh"}
	}}`
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		host, user, pass string
	}{
		{"127.0.0.1:5000", "user", "pass:word"},
		{"registry-1.docker.io", "hub", "secret"},
		{"tok.example", "", "refresh"},
		{"other.example", "", ""},
	} {
		for _, loc := range []string{dir, filepath.Join(dir, "config.json")} {
			u, p, err := Credentials(loc)(tc.host)
			if err != nil || u != tc.user || p != tc.pass {
				t.Errorf("%s via %s: %q %q %v, want %q %q", tc.host, loc, u, p, err, tc.user, tc.pass)
			}
		}
	}
	// A missing config means anonymous access, not an error.
	if u, p, err := Credentials(filepath.Join(dir, "nope"))("x"); u != "" || p != "" || err != nil {
		t.Errorf("missing config: %q %q %v", u, p, err)
	}
}

func TestConfigureHostsPlainHTTP(t *testing.T) {
	ctx := context.Background()
	hostsDir := t.TempDir()
	mirror := filepath.Join(hostsDir, "example.com")
	if err := os.MkdirAll(mirror, 0o755); err != nil {
		t.Fatal(err)
	}
	toml := "server = \"https://example.com\"\n[host.\"http://mirror.local:5000\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
	if err := os.WriteFile(filepath.Join(mirror, "hosts.toml"), []byte(toml), 0o644); err != nil {
		t.Fatal(err)
	}
	hosts, err := ConfigureHosts(ctx, Options{HostsDir: hostsDir, PlainHTTP: true})("example.com")
	if err != nil {
		t.Fatal(err)
	}
	if len(hosts) != 2 || hosts[0].Host != "mirror.local:5000" || hosts[0].Scheme != "http" || hosts[1].Host != "example.com" {
		t.Errorf("hosts.toml not honoured: %+v", hosts)
	}
	plain, err := ConfigureHosts(ctx, Options{HostsDir: hostsDir, PlainHTTP: true})("reg.test:5000")
	if err != nil || len(plain) != 1 || plain[0].Scheme != "http" {
		t.Errorf("plain HTTP default: %+v %v", plain, err)
	}
	if _, err := NewResolver(ctx, Options{HostsDir: hostsDir}); err != nil {
		t.Error(err)
	}
}

func TestSourcePolicy(t *testing.T) {
	dir := t.TempDir()
	for _, d := range []string{"configured.example", "127.0.0.1_5000_", "_default"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		allowed []string
		source  string
		ok      bool
	}{
		{nil, "configured.example/envsnap/base", true},
		{nil, "127.0.0.1:5000/envsnap/base", true},
		{nil, "other.example/envsnap/base", false},
		{nil, "_default/x", false},
		{nil, "configured.example/envsnap/base:tag", false},
		{nil, "configured.example/envsnap/base@sha256:" + strings.Repeat("a", 64), false},
		{nil, "../etc/x", false},
		{nil, "base", false},
		{nil, "", false},
		{[]string{}, "configured.example/envsnap/base", false},
		{[]string{"other.example"}, "other.example/a/b", true},
		{[]string{"other.example"}, "configured.example/a", false},
		{[]string{"other.example/envsnap/"}, "other.example/envsnap/base", true},
		{[]string{"other.example/envsnap/"}, "other.example/envsnapper/base", false},
		{[]string{"other.example/envsnap/"}, "other.example/evil/base", false},
	} {
		err := SourcePolicy{Allowed: tc.allowed, HostsDir: dir}.Check(tc.source)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrSourceNotAllowed)) {
			t.Errorf("allowed %q, source %q: %v, want ok=%v", tc.allowed, tc.source, err, tc.ok)
		}
	}
}
