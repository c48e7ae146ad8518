package tomlconf

import (
	"strings"
	"testing"
)

func TestDecodeNamesUnknownKeys(t *testing.T) {
	type fetch struct {
		Timeout string `toml:"timeout"`
	}
	var cfg struct {
		Root  string `toml:"root"`
		Fetch fetch  `toml:"fetch"`
	}
	doc := "root = \"/r\"\n\n[fetch]\ntimeout = \"1s\"\ntimout = \"2s\"\nretries = 3\n"
	err := Decode(strings.NewReader(doc), &cfg)
	if err == nil {
		t.Fatal("unknown fields decoded without an error")
	}
	want := `unknown fields "fetch.timout" (line 5), "fetch.retries" (line 6)`
	if err.Error() != want {
		t.Fatalf("error %q, want %q", err, want)
	}
	if err := Decode(strings.NewReader("root = \"/r\"\n[fetch]\ntimeout = \"1s\"\n"), &cfg); err != nil || cfg.Fetch.Timeout != "1s" {
		t.Fatalf("a known document: %v, %+v", err, cfg)
	}
	if err := Decode(strings.NewReader("root = \n"), &cfg); err == nil || strings.Contains(err.Error(), "unknown") {
		t.Fatalf("a syntax error: %v", err)
	}
}
