"""One small async function per pipeline stage: read, target, train, report, save."""
